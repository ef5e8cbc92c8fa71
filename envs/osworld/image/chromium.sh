#!/bin/sh
# chromium / google-chrome in a bunshin workspace: flags that keep it CRIU-dumpable (no
# sandbox, no GPU, no io_uring-using services, no network chatter), a fixed profile directory
# (remote debugging needs a non-default one) and a local DevTools port for the task getters.
# Fewer processes: no zygotes (--no-zygote, allowed without the sandbox), the GPU thread and the
# network service inside the browser process, no spare renderer kept for the next site. Each
# process is one more task every snapshot freezes, dumps and restores in every clone: 10
# chromium processes became 5, and a desktop's frozen time and fan-out fell by about a third
# (bench/chromium_process_model.py, bench/results/chromium-process-model.txt).
exec /usr/lib/chromium/chromium \
  --no-sandbox --no-zygote --disable-gpu --in-process-gpu --disable-dev-shm-usage \
  --disable-background-networking --enable-features=NetworkServiceInProcess2 \
  --disable-component-update --disable-sync --no-first-run --disable-quic \
  --disable-default-apps --disable-extensions --no-default-browser-check \
  --disable-breakpad --disable-crash-reporter --password-store=basic --use-mock-keychain \
  --disable-features=Translate,MediaRouter,OptimizationHints,OptimizationGuideModelDownloading,AutofillServerCommunication,OnDeviceModelPerformanceParams,SpareRendererForSitePerProcess \
  --force-renderer-accessibility --disable-session-crashed-bubble --hide-crash-restore-bubble \
  --user-data-dir=/home/user/.config/chromium-bunshin --remote-debugging-port=9222 \
  "$@"
