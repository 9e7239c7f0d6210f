"""The run directory: its layout and records (`runs`), a group's files (`group_files`), the ranks'
step times (`steptimes`), the run's key (`runkey`) and the exchange bound to a run
(`run_exchange`).
"""
