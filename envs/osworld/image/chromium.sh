#!/bin/sh
# chromium / google-chrome in a bunshin workspace: flags that keep it CRIU-dumpable (no
# sandbox, no GPU, no io_uring-using services, no network chatter), a fixed profile directory
# (remote debugging needs a non-default one) and a local DevTools port for the task getters.
exec /usr/lib/chromium/chromium \
  --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --disable-quic \
  --disable-default-apps --disable-extensions --no-default-browser-check \
  --disable-breakpad --disable-crash-reporter --password-store=basic --use-mock-keychain \
  --disable-features=Translate,MediaRouter,OptimizationHints,OptimizationGuideModelDownloading,AutofillServerCommunication,OnDeviceModelPerformanceParams \
  --force-renderer-accessibility --disable-session-crashed-bubble --hide-crash-restore-bubble \
  --user-data-dir=/home/user/.config/chromium-bunshin --remote-debugging-port=9222 \
  "$@"
