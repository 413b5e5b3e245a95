"""Temporary alias so ``import nanojax`` keeps working until llm.py imports nanojax.page_manager.

Delete this file in the change that moves llm.py to PageManager (page_size, num_pages, page_table)."""

from .page_manager import PageManager as BlockManager  # noqa: F401
