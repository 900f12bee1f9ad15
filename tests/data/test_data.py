"""Data modules: the standard-library corpus split by file, window sampling, the synthetic Markov source."""

import collections
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from fp8_lightning.data import ByteTextDataModule, SyntheticDataModule, list_source_files, markov_stream, split_files
from fp8_lightning.data.text import FixedWindows, RandomWindows, read_bytes


@pytest.fixture
def corpus(tmp_path):
    """A small folder of text files, with folders that must be ignored."""
    for i in range(20):
        (tmp_path / f"mod{i:02d}.py").write_text(f"# file {i}\n" + "x = 1\n" * (50 + i))
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("import this\n" * 100)
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__" / "cached.py").write_text("cached\n")
    (tmp_path / "pkg" / "inner.py").write_text("y = 2\n" * 40)
    return tmp_path


def test_listing_skips_third_party_and_caches(corpus):
    names = [p.relative_to(corpus).as_posix() for p in list_source_files(corpus)]
    assert len(names) == 21 and "pkg/inner.py" in names
    assert not any("site-packages" in n or "__pycache__" in n for n in names)
    assert names == sorted(names)


def test_split_is_by_file_disjoint_and_deterministic(corpus):
    files = list_source_files(corpus)
    train, val = split_files(files, 0.2, seed=7)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(files)
    assert len(val) == 4
    assert split_files(files, 0.2, seed=7) == (train, val)
    assert split_files(files, 0.2, seed=8) != (train, val)


def test_split_needs_two_files(corpus):
    with pytest.raises(ValueError, match="at least 2 files"):
        split_files(list_source_files(corpus)[:1], 0.5, seed=0)


def test_windows_are_shifted_pairs_of_the_text():
    data = torch.arange(100, dtype=torch.uint8)
    x, y = FixedWindows(data, 8)[3]
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    assert len(FixedWindows(data, 8)) == 12 and len(FixedWindows(data, 8, max_windows=5)) == 5
    random_windows = RandomWindows(data, 8, num_samples=50, seed=3)
    for i in range(50):
        x, y = random_windows[i]
        assert torch.equal(y[:-1], x[1:]) and torch.equal(x, random_windows[i][0])  # reproducible per index
    assert len({int(random_windows[i][0][0]) for i in range(50)}) > 10


def test_datamodule_on_a_folder(corpus):
    dm = ByteTextDataModule(root=str(corpus), block_size=16, batch_size=4, val_fraction=0.2, train_samples=40, seed=1)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    train_files, val_files = split_files(list_source_files(corpus), 0.2, seed=1)
    assert dm.stats["val_bytes"] == read_bytes(val_files).numel()
    assert dm.stats["train_bytes"] + dm.stats["val_bytes"] == sum(len(f.read_bytes()) for f in train_files + val_files) + 2 * (
        len(train_files) - 1 + len(val_files) - 1
    )  # file contents plus the 2-byte separators


def test_default_corpus_is_the_running_standard_library():
    dm = ByteTextDataModule(block_size=64, max_files=30, max_val_windows=8, train_samples=16)
    assert dm.corpus_root() == Path(sysconfig.get_paths()["stdlib"])
    dm.setup("fit")
    assert dm.stats["train_files"] + dm.stats["val_files"] == 30 and dm.stats["val_files"] >= 1
    x, _ = dm.train_set[0]
    assert x.max() < 256
    assert b"def " in read_bytes(list_source_files(dm.corpus_root())[:50]).numpy().tobytes()


def test_missing_root_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        ByteTextDataModule(root=str(tmp_path / "nope")).setup()


def test_markov_stream_has_the_stated_entropy():
    branching = 4
    stream = markov_stream(200_000, vocab_size=32, branching=branching, seed=0).tolist()
    successors = collections.defaultdict(collections.Counter)
    for a, b in zip(stream, stream[1:]):
        successors[a][b] += 1
    assert max(len(c) for c in successors.values()) == branching
    total = len(stream) - 1
    conditional_entropy = -sum(n / total * math.log(n / sum(c.values())) for c in successors.values() for n in c.values())
    assert conditional_entropy == pytest.approx(math.log(branching), abs=0.01)


def test_synthetic_datamodule_is_deterministic():
    a, b = SyntheticDataModule(seed=5), SyntheticDataModule(seed=5)
    a.setup(), b.setup()
    assert torch.equal(a.train_set[3][0], b.train_set[3][0]) and a.entropy_floor == pytest.approx(math.log(4))


def test_resumable_loader_continues_where_its_state_was_saved():
    from fp8_lightning.data.resumable import ResumableDataLoader

    data = torch.arange(20)
    first = ResumableDataLoader(data, batch_size=3)  # 7 batches, the last one short
    seen = []
    for batch in first:
        seen.append(batch)
        if len(seen) == 4:
            state = first.state_dict()
            break
    assert state == {"batches_yielded": 4}
    second = ResumableDataLoader(data, batch_size=3)
    second.load_state_dict(state)
    rest = list(second)
    assert torch.equal(torch.cat(seen + rest), data)  # nothing repeated, nothing lost
    assert second.state_dict() == {"batches_yielded": 7}
    assert len(list(second)) == 7  # the next pass starts from the beginning
    second.load_state_dict({"batches_yielded": 7})  # saved at the end of a pass: a new pass follows
    assert len(list(second)) == 7
    with pytest.raises(KeyError, match="batches_yielded"):
        second.load_state_dict({})
