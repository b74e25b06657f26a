"""The API key file: its content, stripped; every refusal names what is wrong and never echoes the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.gemini import keys
from picker.gemini.keys import read_key_file


def test_the_key_is_the_files_content_without_surrounding_whitespace(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("  AIza-secret-123\n")
    assert read_key_file(str(f)) == "AIza-secret-123"


@pytest.mark.parametrize(
    ("content", "why"),
    [(b"", "empty"), (b"  \n", "empty"), (b"two words-secret", "space"), (b"tab\tsecret", "space"),
     ("clé-secret".encode(), "ASCII")],
)  # fmt: skip
def test_a_bad_key_file_is_refused_without_echoing_it(tmp_path: Path, content: bytes, why: str) -> None:
    f = tmp_path / "key"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=why) as exc:
        read_key_file(str(f))
    assert "secret" not in str(exc.value)


def test_a_missing_or_oversized_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(str(tmp_path / "absent"))
    big = tmp_path / "big"
    big.write_bytes(b"x" * (keys.KEY_FILE_MAX_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_key_file(str(big))
