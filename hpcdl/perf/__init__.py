"""Performance: the scale planner (`hpcdl.perf.planner`) and, beside it, figures of speed."""

PLANNED_WORKLOADS = ("hep",)  # the planner models the HEP network (hpcdl.perf.model.hep_network)
