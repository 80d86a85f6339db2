// Command kube-controller-manager is the upstream Kubernetes controller manager, built from
// the k8s.io/kubernetes module. It is a copy of k/k's
// cmd/kube-controller-manager/controller-manager.go: the same imports for side effects and
// the same entry point.
package main

import (
	"os"
	_ "time/tzdata" // for CronJob time zone support

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // for JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // load all the prometheus client-go plugins
	_ "k8s.io/component-base/metrics/prometheus/version"  // for version metric registration
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	command := app.NewControllerManagerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
