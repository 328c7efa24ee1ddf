#!/usr/bin/env bash
# A job longer than one device call (10 min), run on across calls: the machine keeps a process that started its
# own session (setsid) until it goes back, so the next call, made at once, can wait for it.
#
#   bash bench/detach.sh start NAME 'STAGES=gpusuite bash bench/gpu_session.sh'   # OUT=/tmp/detach/NAME for it
#   bash bench/detach.sh wait NAME 560    # up to 560 s; /tmp/detach/NAME to $OUT/NAME.tgz (a call brings back 8
#                                         # files at most); rc 0 once it has ended
set -uo pipefail
dir=/tmp/detach/$2
case $1 in
  start) mkdir -p "$dir"
         OUT=$dir setsid bash -c "$3; echo \$? > $dir/rc" > "$dir/job.log" 2>&1 < /dev/null &
         echo "started $2 (pid $!)" ;;
  wait) end=$((SECONDS + ${3:-560}))
        while [ ! -f "$dir/rc" ] && [ $SECONDS -lt $end ]; do sleep 2; done
        tar czf "${OUT:-/tmp/out}/$2.tgz" -C "$dir" .
        if [ -f "$dir/rc" ]; then echo "$2 ended, rc $(cat "$dir/rc")"; else echo "$2 still running"; exit 3; fi ;;
  *) echo "usage: detach.sh start|wait NAME ..." >&2; exit 2 ;;
esac
