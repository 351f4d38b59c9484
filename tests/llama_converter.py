"""llama.cpp's Hugging Face -> GGUF converter, for tests/test_gguf_llama.py: `python tests/llama_converter.py DIR`
puts convert_hf_to_gguf.py (with its conversion package and the gguf-py it imports) in DIR, from the sdist of
llama-cpp-python (the release the benchmark's peer pins), unless it is there already. tox's hf env runs it."""

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

RELEASE = "0.3.36"  # llama-cpp-python's, vendoring llama.cpp's converter of that day
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def fetch(folder: Path) -> Path:
    converter = folder / "convert_hf_to_gguf.py"
    if converter.is_file():
        return converter
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={RELEASE}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{RELEASE}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inside = member.name[len(prefix):] if member.name.startswith(prefix) else ""
                if member.isfile() and inside.startswith(_KEEP):
                    member.name = inside
                    tar.extract(member, folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return converter


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1])))
