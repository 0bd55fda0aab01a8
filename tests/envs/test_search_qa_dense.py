"""Dense search-QA retrieval: build/open round trip, adopting Search-R1-style faiss files, preflight messages.

Real sentence-transformers + faiss on a tiny random static-embedding encoder saved to disk (no model hub
here); the tests skip unless the optional ``dense`` extra is importable. The preflight test needs neither.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from megatron_gigpo.envs.search_qa import Passage, build_retriever, read_passages

REPO = Path(__file__).resolve().parents[2]
BUILD_TOOL = REPO / "tools" / "build_search_index.py"
NUM_PASSAGES = 60
# Same prefix on both sides: a query equal to a passage then scores exactly 1, which also checks that open()
# restores the query prefix from meta.json.
PREFIX = "text: "


@pytest.fixture(scope="module")
def dense_corpus(shared_dir: Path) -> list[Passage]:
    return list(read_passages(shared_dir / "data" / "search_qa" / "wiki18_sample_1000.jsonl"))[:NUM_PASSAGES]


@pytest.fixture(scope="module")
def dense_encoder(tmp_path_factory: pytest.TempPathFactory, dense_corpus: list[Passage]) -> Path:
    """A saved 64-dim random StaticEmbedding sentence-transformers model over the corpus's words."""
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    import torch
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the modules; older releases only have .models
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:
        from sentence_transformers.models import StaticEmbedding
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0}
    for passage in dense_corpus:
        for word in re.findall(r"\w+", passage.contents.lower()):
            vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    encoder_dir = tmp_path_factory.mktemp("encoder") / "static"
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=64)], device="cpu").save(str(encoder_dir))
    return encoder_dir


def _build_tool():
    """tools/build_search_index.py as a module, so its main() runs in-process (no second torch import)."""
    spec = importlib.util.spec_from_file_location("build_search_index", BUILD_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_search_r1_files(folder: Path, encoder: Path, corpus: list[Passage], *, metric: str = "ip") -> Path:
    """``e5_Flat.index`` + ``wiki-18.jsonl`` the way Search-R1 ships them: a raw faiss index, {id, contents}."""
    import faiss
    from sentence_transformers import SentenceTransformer

    folder.mkdir(parents=True, exist_ok=True)
    model = SentenceTransformer(str(encoder), device="cpu")
    vectors = model.encode([PREFIX + p.contents for p in corpus], normalize_embeddings=True)  # (N, 64)
    index = faiss.IndexFlatIP(vectors.shape[1]) if metric == "ip" else faiss.IndexFlatL2(vectors.shape[1])
    index.add(vectors.astype("float32"))
    faiss.write_index(index, str(folder / "e5_Flat.index"))
    with (folder / "wiki-18.jsonl").open("w", encoding="utf-8") as handle:
        for p in corpus:
            handle.write(json.dumps({"id": p.id, "contents": p.contents}) + "\n")
    return folder


@pytest.mark.integration
def test_dense_retriever_round_trip(tmp_path: Path, dense_corpus: list[Passage], dense_encoder: Path):
    from megatron_gigpo.envs.search_qa.dense import DenseRetriever

    index_dir = tmp_path / "dense_index"
    # In-process build (the CLI path is the same function; a second interpreter would re-import torch).
    built = DenseRetriever.build(
        dense_corpus, str(dense_encoder), index_dir=index_dir, query_prefix=PREFIX, passage_prefix=PREFIX
    )
    assert built.num_passages == NUM_PASSAGES
    assert sorted(p.name for p in index_dir.iterdir()) == [
        "index.faiss", "meta.json", "passage_offsets.npy", "passages.jsonl"]
    with build_retriever("dense", index_dir=index_dir) as retriever:
        assert isinstance(retriever, DenseRetriever) and retriever.num_passages == NUM_PASSAGES
        queries = [dense_corpus[i].contents for i in (0, 17, 59)]
        results = retriever.batch_search(queries, 3)
        assert [hits[0].id for hits in results] == [dense_corpus[i].id for i in (0, 17, 59)]
        assert results[0][0].score == pytest.approx(1.0, abs=1e-4)
        assert retriever.search(queries[1], 3) == results[1]
        assert results == built.batch_search(queries, 3)
    # A directory without the offsets file (an older layout) is scanned for them on open.
    (index_dir / "passage_offsets.npy").unlink()
    with build_retriever("dense", index_dir=index_dir) as retriever:
        assert retriever.batch_search(queries, 3) == results


@pytest.mark.integration
def test_adopted_search_r1_index_matches_self_built(
    tmp_path: Path, dense_corpus: list[Passage], dense_encoder: Path, capsys: pytest.CaptureFixture
):
    from megatron_gigpo.envs.search_qa.dense import DenseRetriever

    raw = _write_search_r1_files(tmp_path / "search_r1", dense_encoder, dense_corpus)
    out = tmp_path / "indexes" / "wiki18_e5"
    argv = ["--backend", "dense", "--adopt-faiss", str(raw / "e5_Flat.index"), "--corpus", str(raw / "wiki-18.jsonl"),
            "--model", str(dense_encoder), "--output", str(out), "--query-prefix", PREFIX, "--passage-prefix", PREFIX]
    assert _build_tool().main(argv) == 0
    assert f"dense index of {NUM_PASSAGES} passages (64-dim" in capsys.readouterr().out
    # Same filesystem: the big files are hard links, not copies; nothing is left beside the output.
    assert (out / "index.faiss").samefile(raw / "e5_Flat.index")
    assert (out / "passages.jsonl").samefile(raw / "wiki-18.jsonl")
    assert [p.name for p in out.parent.iterdir()] == ["wiki18_e5"]
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["query_prefix"], meta["dimension"], meta["num_passages"]) == (PREFIX, 64, NUM_PASSAGES)
    assert meta["adopted_from"]["faiss_index"] == str((raw / "e5_Flat.index").resolve())

    built = DenseRetriever.build(dense_corpus, str(dense_encoder), query_prefix=PREFIX, passage_prefix=PREFIX)
    queries = [dense_corpus[i].contents for i in (0, 5, 31, 59)] + ["an unrelated query about trains"]
    with build_retriever("dense", index_dir=out) as adopted:
        got, want = adopted.batch_search(queries, 3), built.batch_search(queries, 3)
    assert [[p.id for p in hits] for hits in got] == [[p.id for p in hits] for hits in want]
    assert [(p.title, p.text) for hits in got for p in hits] == [(p.title, p.text) for hits in want for p in hits]
    assert [p.score for hits in got for p in hits] == pytest.approx([p.score for hits in want for p in hits], abs=1e-5)
    assert got[0][0].title.startswith('"') and got[0][0].score == pytest.approx(1.0, abs=1e-4)


@pytest.mark.integration
def test_adopt_rejects_mismatched_files(tmp_path: Path, dense_corpus: list[Passage], dense_encoder: Path):
    import faiss
    import numpy as np

    from megatron_gigpo.envs.search_qa.dense import adopt_faiss_index

    raw = _write_search_r1_files(tmp_path / "ok", dense_encoder, dense_corpus)
    index, corpus, out, model = raw / "e5_Flat.index", raw / "wiki-18.jsonl", tmp_path / "out", str(dense_encoder)

    short = tmp_path / "short.jsonl"
    short.write_text("".join(corpus.read_text().splitlines(keepends=True)[:-1]) + "\n\n")  # 59 rows, blank tail
    with pytest.raises(ValueError, match=rf"{re.escape(str(index))} has 60 rows but {re.escape(str(short))} has 59"):
        adopt_faiss_index(index, short, out, model)
    l2 = _write_search_r1_files(tmp_path / "l2", dense_encoder, dense_corpus, metric="l2") / "e5_Flat.index"
    with pytest.raises(ValueError, match=rf"{re.escape(str(l2))}: faiss metric 1 is not inner product"):
        adopt_faiss_index(l2, corpus, out, model)
    wide = tmp_path / "wide.index"
    wide_index = faiss.IndexFlatIP(32)
    wide_index.add(np.zeros((NUM_PASSAGES, 32), dtype="float32"))
    faiss.write_index(wide_index, str(wide))
    with pytest.raises(ValueError, match=rf"{re.escape(str(wide))} holds 32-dim vectors but encoder .* 64 dims"):
        adopt_faiss_index(wide, corpus, out, model)
    with pytest.raises(FileNotFoundError, match=rf"faiss index not found: {re.escape(str(tmp_path / 'nope'))}"):
        adopt_faiss_index(tmp_path / "nope", corpus, out, model)
    with pytest.raises(FileNotFoundError, match="passage corpus not found"):
        adopt_faiss_index(index, tmp_path / "nope.jsonl", out, model)
    with pytest.raises(ValueError, match=rf"{re.escape(str(corpus))} is not a readable faiss index"):
        adopt_faiss_index(corpus, corpus, out, model)
    bad_tail = tmp_path / "bad_tail.jsonl"
    bad_tail.write_text("".join(corpus.read_text().splitlines(keepends=True)[:-1]) + "not json\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad_tail))}: passage row 59 .*invalid JSON"):
        adopt_faiss_index(index, bad_tail, out, model)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    out.mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        adopt_faiss_index(index, corpus, out, model)
    # The tool prints the same one-line error and exits 1.
    assert _build_tool().main(["--backend", "dense", "--adopt-faiss", str(l2), "--corpus", str(corpus),
                               "--model", model, "--output", str(tmp_path / "out2")]) == 1


@pytest.mark.unit
def test_preflight_names_missing_dense_index_and_the_adopt_command(tmp_path: Path):
    from megatron_gigpo.config import load_config
    from megatron_gigpo.envs.registry import check_env_resources

    recipe = REPO / "recipes" / "search_qa" / "qwen2.5-3b-instruct.yaml"
    cfg = load_config(recipe, ["env.search.retriever=dense", f"env.search.index_path={tmp_path / 'wiki18_e5'}"])
    assert (cfg.env.search.retriever, cfg.env.search.top_k) == ("dense", 3)
    problems = [p for p in check_env_resources(cfg.env) if p.startswith("env.search.index_path")]
    assert len(problems) == 1
    assert str(tmp_path / "wiki18_e5") in problems[0] and "does not exist" in problems[0]
    assert "--adopt-faiss e5_Flat.index --corpus wiki-18.jsonl" in problems[0]
    (tmp_path / "wiki18_e5").mkdir()
    (tmp_path / "wiki18_e5" / "meta.json").write_text("{}")
    problems = [p for p in check_env_resources(cfg.env) if p.startswith("env.search.index_path")]
    assert len(problems) == 1 and "lacks index.faiss, passages.jsonl" in problems[0]
    no_index = load_config(recipe, ["env.search.retriever=dense", "env.search.index_path=null"])
    assert any("retriever=dense needs env.search.index_path" in p for p in check_env_resources(no_index.env))
