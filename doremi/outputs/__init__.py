"""A pipeline root's outputs named in one place (the main runs, the stage markers, what each stage's output depends on), so the pipeline that writes them and the reports that read them agree."""
