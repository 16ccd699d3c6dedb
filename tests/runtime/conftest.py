import pytest

from dynamo_sizebackend import devices
from dynamo_sizebackend.compile import pipeline
from dynamo_sizebackend.runtime.cudagraphs import SimulatedGraphFactory


@pytest.fixture
def simulator(monkeypatch):
    """The backend believes CUDA is there and captures on simulated graphs; the list
    holds every factory it made (one per Dynamo graph)."""
    factories: list[SimulatedGraphFactory] = []

    def make():
        factories.append(SimulatedGraphFactory())
        return factories[-1]

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(pipeline.cudagraphs, "CudaGraphFactory", make)
    return factories
