"""Airflow side of tests/cluster/test_airflow.py, run in a subprocess with AIRFLOW_HOME etc. in a temp dir.

Airflow reads its settings from the environment at import and configures logging
process-wide, so it runs apart from the pytest process:

    python tests/airflow_run.py dagbag                 # import errors and tasks of the DAG file
    python tests/airflow_run.py run CONF_JSON [SKIP]   # one DAG run with Airflow's dag.test()

``run`` executes the real tasks (the operator's hook runs spark-submit) with
retries and their delay as the DAG sets them, except ``retry_delay`` = 0; task ids
matching the regex SKIP are marked success instead. The last line printed is
``RESULT <json>``: run id, DAG run state, each task's state and try number, and the
XComs pushed.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

DAG_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines",
                        "airflow_dag.py")


def load_dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DAG_FILE)
    return bag, bag.dags.get("sparkcnn")


def dagbag() -> dict:
    bag, dag = load_dag()
    tasks = {t.task_id: {"type": type(t).__name__, "bases": [c.__name__ for c in type(t).__mro__],
                         "retries": t.retries, "downstream": sorted(t.downstream_task_ids)}
             for t in (dag.tasks if dag else [])}
    return {"import_errors": {str(k): str(v) for k, v in bag.import_errors.items()},
            "dag_ids": sorted(bag.dags), "tasks": tasks}


def run(conf: dict, skip: str | None) -> dict:
    from airflow.models.xcom import XComModel
    from airflow.utils import db
    from airflow.utils.session import create_session
    from sqlalchemy import select

    db.initdb()
    _, dag = load_dag()
    for task in dag.tasks:
        task.retry_delay = timedelta(0)  # retry at once; the number of retries stays the DAG's
    dr = dag.test(run_conf=conf, mark_success_pattern=skip)
    with create_session() as session:
        rows = session.scalars(select(XComModel).where(XComModel.dag_id == dag.dag_id,
                                                       XComModel.run_id == dr.run_id)).all()
        xcom = {f"{r.task_id}.{r.key}": XComModel.deserialize_value(r) for r in rows}
        tis = {ti.task_id: {"state": str(ti.state), "try_number": ti.try_number}
               for ti in dr.get_task_instances(session=session)}
    return {"run_id": dr.run_id, "state": str(dr.state), "tasks": tis, "xcom": xcom}


if __name__ == "__main__":
    if sys.argv[1] == "dagbag":
        out = dagbag()
    else:
        out = run(json.loads(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    print("RESULT " + json.dumps(out, default=str), flush=True)
