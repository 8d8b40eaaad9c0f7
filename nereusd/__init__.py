"""nereusd: the Nereus daemon (Slurm tracking, per-job controllers, store, control plane) and CLIs.

Never imports torch: a head node has no GPU stack, and the daemon must start in well under a second.
"""

from planner.shadow import require_nereus_transitions

require_nereus_transitions()
