"""The processes of a run: a rank or applier (`worker`), a group's life and the run's end
(`lifecycle`), how ranks are launched (`launch`) and the straggler emulator (`emulate`).
"""
