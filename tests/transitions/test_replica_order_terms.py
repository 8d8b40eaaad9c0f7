"""transitions/replica_order.py's terms: unit-level data edges of a model-stage (``_edges``), their
lift to edges between replica classes with each member's predecessors (``link``), and the greedy
class order checked against capacity on every GPU (``class_order``)."""
