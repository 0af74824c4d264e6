"""The demo's corpus: every paragraph once, and no paragraph in both the training and the validation file."""

from __future__ import annotations

from toolkit.run.tiny import write_corpus


def _paragraphs(path) -> list[str]:
    return [p.strip() for p in path.read_text().split("\n\n") if p.strip()]


def test_demo_corpus_has_no_duplicates_and_no_train_validation_overlap(tmp_path):
    # The demo's own size (toolkit/commands/demo.py): the repeats were worst there (150 of 155 validation paragraphs).
    out = write_corpus(tmp_path, max_chars=600_000)
    train, validation = _paragraphs(out / "train.txt"), _paragraphs(out / "validation.txt")
    assert len(train) > 1000 and len(validation) > 50
    assert len(set(train)) == len(train)
    assert len(set(validation)) == len(validation)
    assert not set(train) & set(validation)
    # What the trainer reads (datasets' text builder, sample_by="paragraph") is the same set of documents.
    import datasets

    loaded = datasets.load_dataset("text", data_files=[str(out / "validation.txt")], split="train",
                                   sample_by="paragraph")
    assert not {t.strip() for t in loaded["text"]} & set(train)
