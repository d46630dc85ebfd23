"""Presenting: tables as strings (tables), on the terminal (console), as PNGs (figures), and as
report.md + a self-contained report.html (document). Nothing here measures."""
