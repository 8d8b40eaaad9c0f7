"""An example reward function for etc/jobs/*.toml (the job file names it as ``example/reward.py:score``).

Called once per RL step on the whole batch, in a child process with the job's timeout; returns one
finite float per sample. Responses are decoded text up to EOS; ``finished`` is False when a response
hit ``rollout.max_new_tokens`` without EOS. Keep ``**kwargs``: later versions may pass more fields.
"""


def score(prompts, responses, ground_truths, finished, **kwargs):
    out = []
    for text, answer, done in zip(responses, ground_truths, finished):
        digits = sum(ch.isdigit() for ch in text) / max(len(text), 1)  # format: a number at all
        right = sum(a == b for a, b in zip(text, answer)) / max(len(answer), len(text), 1)
        out.append(0.2 * digits + 0.7 * right + (0.1 if done and text == answer else 0.0))
    return out
