"""`vlmrt batch`: a data set of requests answered into a JSONL file, in one process or on Ray Data actors.
records.py reads the input, output.py owns OUT (resume, torn-line repair), worker.py answers (no Ray there),
runner.py plans and runs the job. Ray is imported only by runner.py, and only when the job runs on it."""
