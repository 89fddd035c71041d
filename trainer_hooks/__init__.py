"""Trainer integrations: colocation for custom loops (`colocate`) and TRL's GRPOTrainer (`trl`).

`trainer_hooks.trl` imports TRL; import it explicitly (`from trainer_hooks.trl import ...`).
"""

from .colocate import ColocatedRollout

__all__ = ["ColocatedRollout"]
