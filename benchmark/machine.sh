# Sourced by the benchmark scripts: `machine_header FILE` writes (and prints) what the machine
# was doing when a run started, so every published number carries its CPU and load.
machine_header() {
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "other processes over 5% CPU:"
    ps -eo pcpu,comm --sort=-pcpu | awk 'NR > 1 && $1 > 5'
  } | tee "$1"
}
