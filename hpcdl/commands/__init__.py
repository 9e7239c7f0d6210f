"""What the CLI's commands do, one module each (`submit`, `resume`, `status`, `logs`, `evaluate`,
`export`, `doctor`), and how they show it (`display`, `progress_plot`).
"""
