"""A run resumed mid-epoch skips the micro-batches already trained by index: they are neither loaded nor collated."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardtune.train.setup import ResumableSampler, epoch_batches_for


class CountingDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size, self.reads = size, []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.reads.append(index)
        return index


def loader_of(dataset: CountingDataset, collated: list[list[int]]) -> DataLoader:
    """As build_loader makes it for a map-style dataset: a shuffling DistributedSampler behind ResumableSampler."""
    sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=7))
    return DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=lambda rows: collated.append(rows) or rows)


def test_resuming_mid_epoch_reads_only_the_batches_left():
    full_data, resumed_data = CountingDataset(40), CountingDataset(40)
    full_collated: list[list[int]] = []
    resumed_collated: list[list[int]] = []
    full = list(epoch_batches_for(loader_of(full_data, full_collated))(3, 0))
    resumed = list(epoch_batches_for(loader_of(resumed_data, resumed_collated))(3, 6))
    assert resumed == full[6:]  # the same batches, in the same order, as the uninterrupted epoch
    assert len(resumed_data.reads) == 20 - 6 * 2 and len(resumed_collated) == len(full) - 6
    assert sorted(resumed_data.reads) == sorted(i for batch in full[6:] for i in batch)


def test_the_next_epoch_starts_from_its_first_batch():
    data, collated = CountingDataset(40), []
    batches = epoch_batches_for(loader_of(data, collated))
    assert len(list(batches(0, 9))) == 1
    assert len(list(batches(1, 0))) == 10  # the skip of the resumed epoch does not carry over
