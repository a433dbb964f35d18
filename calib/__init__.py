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
HELDOUT_FILE = "corpus_heldout.txt"
DOC_SEPARATOR = "<|doc|>"

def calib_paths() -> list[Path]:
    return [ROOT / f for f in CALIB_FILES]

def heldout_path() -> Path:
    return ROOT / HELDOUT_FILE

def documents(path: Path) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    return [d.strip() for d in text.split(DOC_SEPARATOR) if d.strip()]
