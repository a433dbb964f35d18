"""Bundled offline calibration/evaluation corpus (CC0-1.0), written for the TALE toolkit."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
CALIB_FILES = (
    "corpus_encyclopedic.txt",
    "corpus_narrative.txt",
    "corpus_instructional.txt",
    "corpus_science.txt",
    "corpus_dialogue.txt",
    "corpus_society.txt",
)
HELDOUT_FILE = "corpus_heldout.txt"  # the DEV text: tune settings on it
# Held-out TEST texts, not written by this project (provenance and licenses: README.md). Never used for
# calibration nor for choosing settings: report on them.
TEST_FILES = {
    "botchan": "test_botchan.txt",  # Natsume, Botchan, tr. Morri (1919): narrative prose, public domain
    "eb1911": "test_eb1911.txt",  # Encyclopaedia Britannica 11th ed. (1911), "Shakespeare, William": expository prose
}
# `make demo`: a question the base model answers with a clear margin, and a ~2K-token document
# (DEV prose with one planted fact in its middle) asked about that fact at the end
DEMO_PROMPT = "What is the chemical symbol for gold?"
DEMO_ANSWER = "Au"
DEMO_LONG_PROMPT = "demo_long_prompt.txt"
DEMO_FACT = "The code that opens the archive of the printing museum in Mainz is 4817."
DEMO_LONG_ANSWER = "4817"
DOC_SEPARATOR = "<|doc|>"


def calib_paths() -> list[Path]:
    return [ROOT / f for f in CALIB_FILES]


def heldout_path() -> Path:
    return ROOT / HELDOUT_FILE


def text_path(name: str) -> Path:
    """An evaluation text by name: "dev" (corpus_heldout.txt) or one of TEST_FILES."""
    if name == "dev":
        return heldout_path()
    if name not in TEST_FILES:
        raise ValueError(f"unknown text {name!r}: use dev, {', '.join(TEST_FILES)}")
    return ROOT / TEST_FILES[name]


def documents(path: Path) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    return [d.strip() for d in text.split(DOC_SEPARATOR) if d.strip()]
