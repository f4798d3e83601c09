"""What the learner trains on: a recorded training sequence and its episode's advantage."""

from __future__ import annotations

from dataclasses import dataclass

from recorder.trajectories import TrainingSequence


@dataclass(frozen=True)
class Sample:
    """A training sequence and the advantage of the episode it came from. A `filler` row
    weighs nothing (its loss mask is taken as all 0): it evens out the rows of a micro-batch
    across processes."""

    sequence: TrainingSequence
    advantage: float
    filler: bool = False

    @property
    def split(self) -> int:
        """Where the completion starts: the first sampled token."""
        return self.sequence.loss_mask.index(1)
