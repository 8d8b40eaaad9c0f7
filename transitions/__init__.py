"""Nereus transitions: EMU geometry, Split/Merge/Extend/Destroy, transition DAGs, data channel.

Pure modules here import no torch; the channel, executor and checkpoint modules do.
"""

# Marker checked by planner.shadow: the PyPI package of the same import name lacks it.
__nereus__ = True
