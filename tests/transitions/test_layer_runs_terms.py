"""transitions.layer_runs term by term, pure, no processes."""
