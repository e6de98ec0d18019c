"""Benchmarks and checkpoint tools, run as `python -m tools.<name>` from the checkout's root."""

# First, before a tool imports transformers: deltaserve takes the checkout's root off sys.path,
# where our kernels/ would hide Hugging Face's `kernels` package (see deltaserve/__init__.py).
import deltaserve  # noqa: F401
