"""`--cut auto`: the halo-budget rule and the cluster rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepco.cluster import load_cluster
from deepco.partition import Partitioner, PartitionError, choose_cut

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "paper-example1.toml"


@pytest.fixture(scope="module")
def resnet18_224(partition_zoo) -> Partitioner:
    model, _ = partition_zoo("resnet18", 224, 224)
    return Partitioner(model, 224, 224)


def test_deepest_cut_within_the_halo_budget(resnet18_224):
    # exact interior halos at 224: layer1 39 rows (17%), layer2.0 59 (26%), layer2 91 (41%), layer3 195 (87%)
    assert choose_cut(resnet18_224, max_halo=0.25).cut.name == "layer1"
    assert choose_cut(resnet18_224, max_halo=0.5).cut.name == "layer2"
    choice = choose_cut(resnet18_224, max_halo=0.001)
    assert choice.cut.name == resnet18_224.cuts[0].name and "no cut" in choice.reason
    with pytest.raises(PartitionError, match="must be positive"):
        choose_cut(resnet18_224, max_halo=0)


def test_cluster_choice_is_the_least_predicted_time(resnet18_224):
    cluster = load_cluster(EXAMPLE)
    choice = choose_cut(resnet18_224, cluster)
    assert choice.times is not None and set(choice.times) == {c.name for c in resnet18_224.cuts}
    assert choice.times[choice.cut.name] == min(choice.times.values())
    assert "least predicted completion time" in choice.reason
