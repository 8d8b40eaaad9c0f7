"""The trace allocation source (DESIGN.md, "Allocation sources"): RL steps replayed on a virtual clock
through the real per-job controller, against a ground-truth performance model the planner cannot see.

    trace.py     the CSV format (one row per RL step) and its validation
    truth.py     the ground truth: hidden drifting efficiencies, noise, long tail, stragglers, memory
    runner.py    simulated agents + virtual clock driving nereusd.controller.JobController; baselines
    experiments  the paper's results reproduced (bench/sim_results.py writes runs/sim/*.json, *.png)

Nothing here imports torch.
"""
