"""Slurm tracking: one batched poller for all jobs, elastic jobs (anchor + members), member submission.

Modules: commands (the one seam for squeue/scontrol/sbatch/scancel subprocesses), states (Slurm
states -> ours, one table), hostlist (node[1-3] expressions), poller (batched squeue with back-off),
submit (member/anchor sbatch through submitit), elastic (the AllocationSource for Slurm).
"""
