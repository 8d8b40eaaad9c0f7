"""Which early builds a worker makes and what they copy (transitions.early_builds), term by term:
each rejection of a candidate node, the reader list, the redirect on both ends and the runs an
early build copies. Pure, no processes."""
