"""Tools that turn monitor output (V1 run folders, V2 output_dir) into answers: anomaly analyser,
csv2tensorboard, csv2db and the offline HTML report. Each tool is one module; ``monitor_output``
finds and reads the CSV files they share."""
