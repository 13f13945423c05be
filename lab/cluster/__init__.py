"""An emulated cluster on one machine (`hosts`, `net`, `reaper`) and the scale that maps a real
workload onto it (`scale`). See docs/cluster.md."""
