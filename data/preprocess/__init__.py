"""`doremi preprocess`: each domain's documents split into train and validation, tokenized in
parallel tasks and written as token stores, on one machine or on datatrove's executors."""
