"""The run as the offline tools find and describe it: its data files (``files``), their layouts, data
types and header roles (``layout``), the selection by V1 timestamp and data type (``selection``, with
the command-line arguments of that selection in ``options``), the batched DuckDB reader every tool
reads rows through (``read``) and the Python row reader kept for files DuckDB does not take
(``rows``).
"""
