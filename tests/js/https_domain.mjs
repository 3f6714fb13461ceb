// Run by tests/proxy/test_proxy_https.py under the test resolver: the npm SDK with E2B_DOMAIN only
// (no E2B_API_URL / E2B_SANDBOX_URL), trusting the server's CA through NODE_EXTRA_CA_CERTS.
// Commands, files, watch and a PTY over TLS; prints one JSON line, kills its sandbox.
import { Sandbox } from 'e2b'

if (process.env.E2B_SANDBOX_URL || process.env.E2B_API_URL) throw new Error('E2B_DOMAIN only, please')
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const sbx = await Sandbox.create({ timeoutMs: 300_000, metadata: { suite: 'proxy-https-js' } })
const out = { id: sbx.sandboxId, host: sbx.getHost(8000) }
try {
  out.stdout = (await sbx.commands.run('echo js-$((40+2))')).stdout
  await sbx.files.write('/home/user/js.txt', 'js-over-tls')
  out.read = await sbx.files.read('/home/user/js.txt')
  await sbx.files.makeDir('/home/user/jw')
  const seen = new Set()
  const watch = await sbx.files.watchDir('/home/user/jw', (e) => seen.add(e.name))
  await sbx.files.write('/home/user/jw/new.txt', 'x')
  for (let i = 0; i < 100 && !seen.has('new.txt'); i++) await sleep(200)
  await watch.stop()
  out.watched = [...seen].sort()
  let pty = ''
  const dec = new TextDecoder()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { pty += dec.decode(d) } })
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('echo pty-$((6*7)); exit\n'))
  await h.wait().catch(() => {})
  out.pty = pty
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
