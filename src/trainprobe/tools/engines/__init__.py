"""Where the SQL runs: a DuckDB connection locked to the run (``lock``), Apache Spark (``spark``), and
the engines ``diagnose`` and ``diff`` run their questions on (``diagnose``, ``diff``).
"""
