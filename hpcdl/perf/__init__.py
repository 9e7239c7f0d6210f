"""Performance: the scale planner (`hpcdl.perf.planner`) and, beside it, figures of speed."""
