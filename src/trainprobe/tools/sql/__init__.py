"""Every piece of SQL the tools run, built in one place: the names and paths that reach it made safe
(``names``), the shared questions of the query layer (``questions``), the full-tensor views of a
sharded run (``full``), and the SQL of ``diagnose`` (``diagnose``) and ``diff`` (``diff``).
"""
