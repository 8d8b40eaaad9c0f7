"""Nereus's RL engine: a Llama-style decoder from ``planner.models.ModelSpec`` (model), TP/PP/DP
execution of one model-stage under its StagePlan (parallel), torch and vLLM rollout backends (rollout,
vllm_backend), PPO/GRPO/ReMax (ppo, grpo, remax, losses), synthetic verifiable tasks (tasks), weight
sync between layouts (sync), per-stage measurements for calibration (measure) and the driver-side
step loop (loop). What a user brings: prompt files (data), reward functions (rewards), HF tokenizers
(tokenizer) and model directories in and out (hf_io), named in a TOML job file (jobfile). Run a local
job: ``python -m agent.engine.loop --algo grpo``, or ``--job etc/jobs/grpo.toml``.
"""
