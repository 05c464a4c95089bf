"""On resume each checkpoint file is read and checked once in all, not once per rank (issue 34): with
``split_over=`` a process group, rank r hashes the manifest's files i with i mod N = r and the ranks agree, so a
bad file any rank finds is refused on every rank with the same message. One process still checks every file.

The hashing is counted by wrapping ``checkpoint._sha256`` (what reads a file to check it) on each rank.
"""

import os

import pytest
import torch.distributed as dist

from scalebook.comm import launch
from scalebook.train import checkpoint

FILES = 5  # per checkpoint: more than the ranks, and not a multiple of them


def _write_checkpoints(root: str) -> None:
    """Steps 2 and 4, each of FILES files of distinct bytes with a manifest; ``latest`` names step 4."""
    for step in (2, 4):
        folder = checkpoint.step_dir(root, step)
        folder.mkdir(parents=True)
        for i in range(FILES):
            (folder / f"__{i}_0.distcp").write_bytes(os.urandom(10_000 + i))
        checkpoint.write_manifest(root, step)
        checkpoint.mark_complete(root, step)


def _flip(path) -> None:
    content = bytearray(path.read_bytes())
    content[100:104] = bytes(b ^ 0xFF for b in content[100:104])
    path.write_bytes(bytes(content))  # the same size: only the SHA-256 tells


def _counting(hashed: list):
    """``checkpoint._sha256`` that also appends the name of each file it hashes to ``hashed``."""
    sha256 = checkpoint._sha256

    def counted(path):
        hashed.append(path.name)
        return sha256(path)

    return counted


def _verify_on_each_rank(root: str) -> dict:
    """Worker: every rank checks the intact checkpoints, then (rank 0 flips a file of step 4) the corrupt one."""
    if dist.get_rank() == 0:
        _write_checkpoints(root)
    dist.barrier()
    hashed = []
    checkpoint._sha256 = _counting(hashed)  # this rank's process only, which ends with the launch
    out = {"root": root, "intact": checkpoint.newest_intact(root, split_over=dist.group.WORLD), "hashed": list(hashed)}
    dist.barrier()
    if dist.get_rank() == 0:
        _flip(checkpoint.step_dir(root, 4) / "__1_0.distcp")  # file 1: rank 1's to check
    dist.barrier()
    hashed.clear()
    try:
        checkpoint.verify(root, 4, split_over=dist.group.WORLD)
        out["verify"] = "no error"
    except checkpoint.CheckpointError as error:
        out["verify"] = str(error)
    out["fallback"] = checkpoint.newest_intact(root, split_over=dist.group.WORLD)
    out["hashed after"] = list(hashed)
    if dist.get_rank() == 1:  # a file rank 1 cannot read (file 3 of step 2): an error there, not a hang on rank 0
        checkpoint._sha256 = _unreadable("__3_0.distcp", checkpoint._sha256)
    try:
        checkpoint.verify(root, 2, split_over=dist.group.WORLD)
        out["unreadable"] = "no error"
    except checkpoint.CheckpointError as error:
        out["unreadable"] = str(error)
    return out


def _unreadable(name: str, sha256):
    def hashed(path):
        if path.name == name:
            raise PermissionError(13, "Permission denied", str(path))
        return sha256(path)

    return hashed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(_verify_on_each_rank, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=120)


def test_two_ranks_hash_each_file_of_an_intact_checkpoint_once_in_all(ranks):
    assert all(rank["intact"] == (4, []) for rank in ranks)
    hashed = [name for rank in ranks for name in rank["hashed"]]
    manifest = checkpoint.read_manifest(ranks[0]["root"], 4)
    assert sorted(hashed) == sorted(manifest["files"])  # each file once: none twice, none left out
    assert all(0 < len(rank["hashed"]) < len(manifest["files"]) for rank in ranks)  # both ranks share the work


def test_a_file_only_one_rank_hashed_is_refused_on_both_with_one_message(ranks):
    bad = checkpoint.step_dir(ranks[0]["root"], 4) / "__1_0.distcp"
    message = f"{bad} is corrupt: its SHA-256 differs from the one in manifest.json"
    assert [rank["verify"] for rank in ranks] == [message, message]
    assert [rank["fallback"] for rank in ranks] == [(2, [message]), (2, [message])]  # the same step everywhere
    assert "__1_0.distcp" not in ranks[0]["hashed after"]  # rank 0 never read it, yet refuses it


def test_a_file_one_rank_cannot_read_is_refused_on_both_instead_of_leaving_the_other_waiting(ranks):
    bad = checkpoint.step_dir(ranks[0]["root"], 2) / "__3_0.distcp"
    message = f"{bad} is unreadable ([Errno 13] Permission denied: '{bad}')"
    assert [rank["unreadable"] for rank in ranks] == [message, message]


def test_one_process_hashes_every_file_once(tmp_path, monkeypatch):
    _write_checkpoints(tmp_path)
    hashed = []
    monkeypatch.setattr(checkpoint, "_sha256", _counting(hashed))
    assert checkpoint.newest_intact(tmp_path) == (4, [])
    assert sorted(hashed) == sorted(checkpoint.read_manifest(tmp_path, 4)["files"])
