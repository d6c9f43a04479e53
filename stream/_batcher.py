"""Group a stream of sample lists into SampleBatches, with a last-batch policy."""

from __future__ import annotations

from enum import StrEnum

from ._channel import ReceiveChannel, SendChannel
from ._errors import ConfigError
from ._sample import Sample, SampleBatch, samples_nbytes

__all__ = ["LastBatch", "batch_samples", "batches_per_epoch"]


class LastBatch(StrEnum):
    """What to do with an epoch's last, short batch (DALI's LastBatchPolicy).

    PARTIAL yields it short; DROP drops it; FILL completes it by repeating its own samples from
    its first (its ``padded`` count says how many rows are repeats).
    """

    PARTIAL = "partial"
    FILL = "fill"
    DROP = "drop"

    @classmethod
    def parse(cls, value: str | LastBatch) -> LastBatch:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"last_batch must be one of {[p.value for p in cls]}, got {value!r}") from None


def batches_per_epoch(samples: int, batch_size: int, policy: LastBatch) -> int:
    full, rest = divmod(samples, batch_size)
    return full + (1 if rest and policy is not LastBatch.DROP else 0)


async def batch_samples(
    chunks: ReceiveChannel[list[Sample]],
    batches: SendChannel[SampleBatch],
    *,
    batch_size: int,
    policy: LastBatch,
    epoch: int,
    first_index: int,
) -> int:
    """Receive sample lists until END; send SampleBatches numbered from ``first_index`` (each counted
    in the channel by its fields' bytes, as the reader's chunks are); then close.
    Returns the number after the last batch's: the epoch's batch count when it started at 0."""
    pending: list[Sample] = []
    index = first_index
    try:
        async for chunk in chunks:
            pending.extend(chunk)
            while len(pending) >= batch_size:
                batch, pending = pending[:batch_size], pending[batch_size:]
                await batches.send(SampleBatch(batch, epoch, index), samples_nbytes(batch))
                index += 1
        if pending and policy is not LastBatch.DROP:
            padded, nbytes = 0, samples_nbytes(pending)  # the repeats below hold no bytes of their own
            if policy is LastBatch.FILL:
                padded = batch_size - len(pending)
                pending = pending + [pending[i % len(pending)] for i in range(padded)]
            await batches.send(SampleBatch(pending, epoch, index, padded=padded), nbytes)
            index += 1
        return index
    finally:
        await batches.aclose()
