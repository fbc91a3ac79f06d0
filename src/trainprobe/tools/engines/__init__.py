"""Where the SQL runs: one interface (``base``: :class:`~trainprobe.tools.engines.base.Engine`), its
DuckDB engine (``duckdb_engine``) and its Spark engine (``spark_engine``); a DuckDB connection
locked to the run (``lock``); the query layer on Apache Spark (``spark``).
"""
