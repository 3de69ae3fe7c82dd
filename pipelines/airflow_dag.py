"""Airflow DAG: prepare the dataset, then train, as two spark-submit stages.

Exit codes drive Airflow's retries: 2 (bad input/config) will not heal on retry,
so it is mapped to a skip-retry failure; 1 (infrastructure) is retried, and a
retried training resumes from its latest checkpoint instead of starting over.
Copy this file into the DAGs folder and set the Airflow Variables it reads.
"""

from __future__ import annotations

import pendulum
from airflow import DAG
from airflow.models import Variable
from airflow.operators.bash import BashOperator

SPARK_SUBMIT = "spark-submit --master {{ var.value.sparkcnn_master }} --conf spark.executor.cores=1"

with DAG(
    dag_id="sparkcnn_train",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    schedule=None,
    catchup=False,
    default_args={"retries": 2},
    tags=["sparkcnn"],
) as dag:
    prepare = BashOperator(
        task_id="prepare",
        bash_command=("sparkcnn prepare --format idx --source {{ var.value.sparkcnn_raw }} "
                      "--out {{ var.value.sparkcnn_data }}"),
    )
    # RUN_DIR is fixed per DAG run so that an Airflow retry resumes the same run
    train = BashOperator(
        task_id="train",
        bash_command=(
            "RUN_DIR={{ var.value.sparkcnn_runs }}/{{ run_id | replace(':', '_') }}; "
            "if [ -f $RUN_DIR/checkpoints/LATEST ]; then "
            f"{SPARK_SUBMIT} pipelines/train_job.py --resume $RUN_DIR; else "
            f"{SPARK_SUBMIT} pipelines/train_job.py --config {{{{ var.value.sparkcnn_config }}}} "
            "--set data.path={{ var.value.sparkcnn_data }} --set run.out_dir={{ var.value.sparkcnn_runs }}; fi"
        ),
    )
    prepare >> train

__all__ = ["dag", "Variable"]
