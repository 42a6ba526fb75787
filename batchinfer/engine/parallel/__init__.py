"""Many ranks as one runner: tensor- and pipeline-parallel runners, rank processes and executors."""
