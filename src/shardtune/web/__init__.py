"""Watching runs: `shardtune status` (a table in the terminal) and `shardtune web` (a live page, the `web` extra).

runs.py and rank_table.py read a run folder and import nothing heavy; server.py (Starlette) and processes.py
(start detached, stop every rank) are the page's.
"""
