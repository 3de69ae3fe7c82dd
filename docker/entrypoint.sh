#!/usr/bin/env bash
# Entrypoint of the sparkcnn images, one image for driver and executors, after the convention
# of Spark's own Kubernetes images (the pip package does not ship their script):
#   driver ARGS...  spark-submit --deploy-mode client ARGS, bound to $SPARK_DRIVER_BIND_ADDRESS
#                   (Kubernetes starts the driver pod this way in cluster mode)
#   executor        the KubernetesExecutorBackend JVM, configured by the SPARK_* variables that
#                   Spark's Kubernetes scheduler sets on executor pods
#   anything else   run as given: sparkcnn train ..., spark-submit ..., spark-class ... (a
#                   standalone master or worker, see docker/compose.yaml)
#   --help          this usage
set -euo pipefail

usage() {
  cat <<'EOF'
usage: entrypoint.sh driver SPARK-SUBMIT-ARGS...   spark-submit --deploy-mode client, bound to $SPARK_DRIVER_BIND_ADDRESS
       entrypoint.sh executor                      an executor JVM (KubernetesExecutorBackend) registering with
                                                   $SPARK_DRIVER_URL, from the SPARK_EXECUTOR_* variables of a pod
       entrypoint.sh COMMAND [ARGS...]             COMMAND as given, e.g. sparkcnn train --config ...
       entrypoint.sh --help                        this message (sparkcnn --help: the command line)
Spark comes from $SPARK_HOME, else from the pyspark package of python3.
EOF
}

case "${1:-}" in
  --help | -h | help)
    usage
    exit 0
    ;;
  "")
    usage >&2
    exit 2
    ;;
esac

# A pod may run under a UID without a passwd entry (runAsUser, OpenShift); the JVM needs one.
uid="$(id -u)"
if ! getent passwd "$uid" >/dev/null && [ -w /etc/passwd ]; then
  echo "$uid:x:$uid:$(id -g):${SPARK_USER_NAME:-anonymous uid}:${HOME:-/tmp}:/bin/false" >>/etc/passwd
fi

if [ -z "${SPARK_HOME:-}" ]; then  # pyspark's pip package is the Spark distribution
  if ! SPARK_HOME="$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))' 2>/dev/null)"; then
    echo "entrypoint.sh: SPARK_HOME is not set and python3 ($(command -v python3 || echo none)) has no pyspark" >&2
    exit 2
  fi
  export SPARK_HOME
fi

# tini as PID 1: forwards signals and reaps the orphans of Python workers
init=()
if command -v tini >/dev/null; then
  init=(tini -s --)
fi

case "${1:-}" in
  driver)
    shift
    exec "${init[@]}" "$SPARK_HOME/bin/spark-submit" \
      --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS:?is not set (Kubernetes sets it on driver pods)}" \
      --deploy-mode client "$@"
    ;;
  executor)
    shift
    # the executor's JVM options arrive as SPARK_JAVA_OPT_0, SPARK_JAVA_OPT_1, ... in that order
    java_opts=()
    for i in $(compgen -v SPARK_JAVA_OPT_ | sed 's/^SPARK_JAVA_OPT_//' | sort -n); do
      var="SPARK_JAVA_OPT_$i"
      java_opts+=("${!var}")
    done
    classpath="${SPARK_CLASSPATH:+$SPARK_CLASSPATH:}$SPARK_HOME/jars/*"
    if [ -n "${SPARK_EXTRA_CLASSPATH:-}" ]; then classpath="$classpath:$SPARK_EXTRA_CLASSPATH"; fi
    if [ -n "${HADOOP_CONF_DIR:-}" ]; then classpath="$HADOOP_CONF_DIR:$classpath"; fi
    classpath="${SPARK_CONF_DIR:-$SPARK_HOME/conf}:$classpath"
    if [ -n "${SPARK_DIST_CLASSPATH:-}" ]; then classpath="$classpath:$SPARK_DIST_CLASSPATH"; fi
    need="is not set (Spark's Kubernetes scheduler sets it on executor pods)"
    exec "${init[@]}" "${JAVA_HOME:+$JAVA_HOME/bin/}java" "${java_opts[@]}" \
      -Xms"${SPARK_EXECUTOR_MEMORY:?$need}" -Xmx"$SPARK_EXECUTOR_MEMORY" -cp "$classpath" \
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
      --driver-url "${SPARK_DRIVER_URL:?$need}" \
      --executor-id "${SPARK_EXECUTOR_ID:?$need}" \
      --cores "${SPARK_EXECUTOR_CORES:?$need}" \
      --app-id "${SPARK_APPLICATION_ID:?$need}" \
      --hostname "${SPARK_EXECUTOR_POD_IP:?$need}" \
      --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID:?$need}" \
      --podName "${SPARK_EXECUTOR_POD_NAME:?$need}"
    ;;
  *)
    exec "${init[@]}" "$@"
    ;;
esac
