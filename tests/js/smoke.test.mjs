// Smoke test of an agentenv server with the unmodified official E2B JS SDK (npm `e2b`, pinned in
// package.json). Run by tests/e2e/test_js_sdk.py with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL
// pointing at the server under test; can also be run by hand:
//   E2B_API_KEY=... E2B_API_URL=http://127.0.0.1:PORT E2B_SANDBOX_URL=http://127.0.0.1:PORT \
//     node --test tests/js/smoke.test.mjs
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[name]) {
    throw new Error(`${name} must be set (see the comment at the top of this file)`)
  }
}

async function listAll(query) {
  const found = []
  const paginator = Sandbox.list({ query })
  while (paginator.hasNext) {
    found.push(...(await paginator.nextItems()))
  }
  return found
}

test('JS SDK: create, run, files, list, kill', { timeout: 240_000 }, async () => {
  const runId = randomBytes(8).toString('hex')
  const sbx = await Sandbox.create({
    metadata: { suite: 'js-smoke', run: runId },
    envs: { JS_SMOKE_VAR: `value-${runId}` },
    timeoutMs: 180_000,
  })
  let killed = false
  try {
    assert.match(sbx.sandboxId, /^[a-z0-9]+$/)
    assert.equal(await sbx.isRunning(), true)

    // commands.run with streamed stdout
    const chunks = []
    const result = await sbx.commands.run(
      'echo first; sleep 1; echo "second $JS_SMOKE_VAR"; echo oops >&2',
      { onStdout: (data) => { chunks.push(data) } },
    )
    assert.equal(result.exitCode, 0)
    assert.equal(result.stdout, `first\nsecond value-${runId}\n`)
    assert.equal(result.stderr, 'oops\n')
    assert.equal(chunks.join(''), result.stdout)

    const who = await sbx.commands.run('whoami')
    assert.equal(who.stdout.trim(), 'user')

    // files: write, read, list, exists
    const dir = `/home/user/js-smoke-${runId}`
    const content = `hello from node ${runId}\n`
    const info = await sbx.files.write(`${dir}/hello.txt`, content)
    assert.equal(info.path, `${dir}/hello.txt`)
    assert.equal(await sbx.files.read(`${dir}/hello.txt`), content)
    const bytes = randomBytes(4096)
    await sbx.files.write(`${dir}/blob.bin`, bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength))
    const readBack = await sbx.files.read(`${dir}/blob.bin`, { format: 'bytes' })
    assert.deepEqual(Buffer.from(readBack), bytes)
    const entries = await sbx.files.list(dir)
    assert.deepEqual(entries.map((e) => e.name).sort(), ['blob.bin', 'hello.txt'])
    const hello = entries.find((e) => e.name === 'hello.txt')
    assert.equal(hello.type, 'file')
    assert.equal(hello.size, Buffer.byteLength(content))
    assert.equal(await sbx.files.exists(`${dir}/nope.txt`), false)
    // the file written through the API is visible to processes in the sandbox
    const cat = await sbx.commands.run(`cat ${dir}/hello.txt`)
    assert.equal(cat.stdout, content)

    // Sandbox.list with a metadata filter
    const listed = await listAll({ metadata: { run: runId } })
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
    assert.equal(listed[0].metadata.suite, 'js-smoke')
    assert.equal(listed[0].state, 'running')

    // kill
    assert.equal(await sbx.kill(), true)
    killed = true
    assert.equal(await sbx.isRunning(), false)
    assert.deepEqual(await listAll({ metadata: { run: runId } }), [])
    assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  } finally {
    if (!killed) {
      await sbx.kill().catch(() => {})
    }
  }
})
