// Engine replicas (`--data-parallel-size`): which replica the dashboard follows, each replica's
// load and prefix hit rate, and the router's recent decisions. Hidden when one engine serves.
import { useEffect, useState } from "react";
import { getReplicas } from "../../api/client";
import type { ReplicasState } from "../../core/wire";
import { followReplica } from "../../live/socket";
import { Card } from "../components/Card";

const POLL_MS = 2000;

export function ReplicasPanel(props: { onFollow: (replica: number) => void; pollMs?: number }) {
  const [state, setState] = useState<ReplicasState | null>(null);
  const [followed, setFollowed] = useState(0);
  const pollMs = props.pollMs ?? POLL_MS;

  useEffect(() => {
    let stopped = false;
    const poll = () => {
      getReplicas().then(
        (next) => {
          if (stopped) return;
          setState(next);
          if ((next.replicas ?? []).length === 0) clearInterval(timer); // one engine: it stays one
        },
        () => { /* not ready yet: try again */ },
      );
    };
    const timer = setInterval(poll, pollMs);
    poll();
    return () => { stopped = true; clearInterval(timer); };
  }, [pollMs]);

  const replicas = state?.replicas ?? [];
  if (replicas.length === 0) return null;
  const decisions = [...(state?.decisions ?? [])].reverse(); // newest first

  const follow = (replica: number) => {
    setFollowed(replica);
    followReplica(replica);
    props.onFollow(replica);
  };

  const switcher = (
    <label className="replica-switcher">
      Events of{" "}
      <select aria-label="Replica" data-testid="replica-switcher" value={followed} onChange={(e) => follow(Number(e.target.value))}>
        {replicas.map((r) => (
          <option key={r.id} value={r.id}>replica {r.id}{r.alive === false ? " (dead)" : ""}</option>
        ))}
      </select>
    </label>
  );

  return (
    <Card title="Replicas" subtitle={`routing: ${state?.policy ?? ""}`} actions={switcher} testId="replicas-panel">
      <table className="replicas-table" aria-label="Replicas">
        <thead>
          <tr><th>replica</th><th>node</th><th>state</th><th>running</th><th>waiting</th><th>routed</th><th>prefix hit rate</th></tr>
        </thead>
        <tbody>
          {replicas.map((r) => (
            <tr key={r.id} data-testid={`replica-row-${r.id}`}>
              <td>{r.id}</td>
              <td>{r.node}</td>
              <td title={r.dead_reason ?? undefined}>{r.alive === false ? "dead" : "alive"}</td>
              <td>{r.running ?? 0}</td>
              <td>{r.waiting ?? 0}</td>
              <td>{r.routed ?? 0}</td>
              <td>{((r.prefix_hit_rate ?? 0) * 100).toFixed(0)}%</td>
            </tr>
          ))}
        </tbody>
      </table>
      <h3 className="routing-title">Routing</h3>
      <table className="routing-table" aria-label="Routing decisions" data-testid="routing-decisions">
        <thead>
          <tr><th>request</th><th>replica</th><th>matched blocks</th><th>reason</th></tr>
        </thead>
        <tbody>
          {decisions.map((d, i) => (
            <tr key={`${d.request_id}-${i}`}>
              <td>{d.request_id}</td>
              <td>{d.replica}</td>
              <td>{d.matched_blocks ?? 0} / {d.prompt_blocks ?? 0}</td>
              <td>{d.reason ?? "least_loaded"}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </Card>
  );
}
