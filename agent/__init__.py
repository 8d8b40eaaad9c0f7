"""Nereus node agent, workers, job driver and the RL engine."""

from planner.shadow import require_nereus_transitions

require_nereus_transitions()
