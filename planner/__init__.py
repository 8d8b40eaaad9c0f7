"""Nereus planner: specs, memory and cost models, calibration, plan search and admission.

Pure: no torch, no I/O. Everything here is frozen data plus fast functions over it.
"""

__nereus__ = True
