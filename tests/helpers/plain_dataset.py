"""A plain map-style data set over a list of samples: no ``sample_metadata(i)``, nothing but ``torch``'s Dataset."""

from torch.utils.data import Dataset


class PlainDataset(Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]
